"""Coordinator behaviour that only asynchronous drivers (Ray) exercise: messages that cross in flight."""

from bidirl import config as cfgmod
from bidirl import control
from bidirl.core import protocol as P


def test_a_group_that_completes_while_its_migration_is_in_flight_is_not_waited_for():
    c = control.build(cfgmod.load("tiny-cpu"), "opportunistic", steps=2, seed=0).coordinator
    cmds = c.handle(P.Started(0.0))
    gen = next(cmd for cmd in cmds if isinstance(cmd, P.Generate))
    gid = gen.tasks[0].group_id
    c.migrating.add(gid)                      # as if an Interrupt(migrate) for it had been sent
    done = P.GroupState(gid, 5, (3,) * 4, (True,) * 4, 0)
    c.handle(P.GroupFinished(0.1, gen.worker, done))
    assert gid not in c.migrating
    # the interrupt's answer, which no longer lists the group, leaves the buffer consistent
    c.handle(P.GenerationStopped(0.2, gen.worker, ()))
    assert c.buffer.groups[gid].status == "complete"
