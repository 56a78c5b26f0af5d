"""Former name of `deployments.sessions.pool`, kept importable for one release."""

import sys

from deployments.sessions import pool as _moved

sys.modules[__name__] = _moved
