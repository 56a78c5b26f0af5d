"""Former name of `deployments.sessions.adoption`, kept importable for one release."""

import sys

from deployments.sessions import adoption as _moved

sys.modules[__name__] = _moved
