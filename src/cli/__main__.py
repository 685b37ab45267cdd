"""`python -m mudpuppy.cli ...`: the same CLI as the `mudpuppy` command (and `python -m mudpuppy`)."""

from . import main

if __name__ == "__main__":
    main()
