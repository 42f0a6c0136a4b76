"""``python -m bidirl ...`` runs the command line (:func:`bidirl.cli.main`)."""

import sys

from bidirl.cli import main

if __name__ == "__main__":
    sys.exit(main())
