"""PEP 562 lazy names, shared by meshtron's packages: a name loads its module on first
use, so importing a package imports no torch (the command line checks its flags
before torch's seconds of import). Imports nothing of torch or of meshtron.
"""
import importlib
import sys


def lazy(package: str, homes: dict, submodules: tuple = ()):
    """`__getattr__` and `__dir__` for `package`. `homes`: name -> its module, or
    (module, its name there); a module may be relative to `package` (".config").
    `submodules`: modules of the package loaded by name (`package.name`)."""
    def __getattr__(name: str):
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attr = homes[name] if isinstance(homes[name], tuple) else (homes[name], name)
        return getattr(importlib.import_module(module, package), attr)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *homes, *submodules})

    return __getattr__, __dir__
