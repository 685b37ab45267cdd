"""`python -m mudpuppy ...`: the same CLI as the `mudpuppy` command."""

from .cli import main

if __name__ == "__main__":
    main()
