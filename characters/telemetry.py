"""Former name of `characters.stage_times`, kept importable for one release."""

import sys

from characters import stage_times as _moved

sys.modules[__name__] = _moved
