"""`python -m pdserve ...` is the `pdserve` command."""
import sys

from pdserve.cli import main

if __name__ == "__main__":  # not in a process multiprocessing spawns
    sys.exit(main())
