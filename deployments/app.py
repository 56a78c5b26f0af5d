"""Deprecated alias of `deployments.api.app`, kept for one release (0.2): `deployments.app:build_app` still
works in `serve run` and RayService manifests; write `deployments.api.app:build_app` instead."""

import warnings

from deployments.api.app import APP_NAME, GRPC_SERVICER_FUNCTIONS, CharactersIngress, build_app, parse_args

__all__ = ["APP_NAME", "GRPC_SERVICER_FUNCTIONS", "CharactersIngress", "build_app", "parse_args"]

warnings.warn("deployments.app is deprecated: use deployments.api.app (deployments.api.app:build_app); the alias "
              "goes in the next release", DeprecationWarning, stacklevel=2)
