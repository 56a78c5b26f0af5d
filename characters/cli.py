"""Former name of `characters.commands`, kept importable for one release."""

import sys

from characters import commands as _moved

sys.modules[__name__] = _moved
