"""Former name of `deployments.pipeline.output`, kept importable for one release."""

import sys

from deployments.pipeline import output as _moved

sys.modules[__name__] = _moved
