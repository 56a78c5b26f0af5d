"""Former name of `characters.commands`, kept importable (and runnable with `python -m`) for one release."""

import sys

from characters import commands as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
