"""voltserve: OpenAI-compatible LLM serving for NVIDIA Volta (SM70) and newer GPUs."""

import os as _os

__version__ = "0.1.0"

# An install maps the root folders shared/, services/ and kernels/ into voltserve.* (setuptools
# package-dir). A bare source checkout on PYTHONPATH (air-gapped GPU hosts, scripts/gpu_check.sh)
# gets the same mapping by also searching the checkout's root for voltserve's subpackages.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "shared", "protocol.py")) and _root not in __path__:
    __path__.append(_root)
