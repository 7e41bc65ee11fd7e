"""elmo-pipeline's one import package: `elmo_pipeline.model`, `.pipeline`, `.transforms`, `.output`, `.formats`, `.fsio`,
`.tokenization`, `.training`, `.downstream`.

Installed, setup.py maps the repository's top-level folders (model/, pipeline/, ...) under this name. Run from a
checkout without installing (PYTHONPATH=<checkout>), this package finds the same folders beside it.
"""
import os as _os

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "setup.py")) and _os.path.isfile(_os.path.join(_ROOT, "model", "bilm.py")):
    __path__.append(_ROOT)   # a checkout: the subpackages are the top-level folders
