"""What every driver shares (``docs/architecture.md``): the driver base that feeds the coordinator and executes
its commands (``driver``), a job's control plane (``assemble``), the discrete-event loop (``loop``) and run
checkpoints with resume (``checkpoints``)."""
