"""voltserve: OpenAI-compatible LLM serving for NVIDIA Volta (SM70) and newer GPUs."""

import os as _os

__version__ = "0.1.0"

# An install maps the root folders shared/, services/ and kernels/ into voltserve.* (setuptools
# package-dir). A bare source checkout (air-gapped GPU hosts: scripts/gpu_check.sh puts a link to
# this folder on PYTHONPATH) gets the same mapping by also searching the checkout's root for
# voltserve's subpackages. The root is searched for this package only, never put on sys.path.
_root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
if _os.path.isfile(_os.path.join(_root, "shared", "protocol.py")) and _root not in __path__:
    __path__.append(_root)
