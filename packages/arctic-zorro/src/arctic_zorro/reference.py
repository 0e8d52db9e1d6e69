"""The plain-torch backend's first name, kept working: ``backend: reference`` and this module.

arctic-zorro 0.1.0 registered the plain transformers + torch AdamW backend as ``reference``, in
this module; 0.2.0 named it ``torch`` (``arctic_zorro.torch_backend``), since "reference" is also
the config's section for the frozen KL model. Configs and imports that use the old name get the
same classes, with a DeprecationWarning naming the new one.
"""

from __future__ import annotations

import warnings

from arctic_zorro.torch_backend import TorchLogProbEngine, TorchOptions, TorchTrainer

# stacklevel 2: the line that imported this module (the registry's, for a config naming the backend).
warnings.warn("the backend name 'reference' and arctic_zorro.reference are deprecated: use backend 'torch' "
              "(arctic_zorro.torch_backend: TorchTrainer, TorchLogProbEngine)", DeprecationWarning, stacklevel=2)

ReferenceTrainer = TorchTrainer
ReferenceLogProbEngine = TorchLogProbEngine
ReferenceOptions = TorchOptions

__all__ = ["ReferenceLogProbEngine", "ReferenceOptions", "ReferenceTrainer"]
