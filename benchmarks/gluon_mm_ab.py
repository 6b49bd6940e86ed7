"""``gluon_mm_variants.py`` with one more variant, 'old': the public dispatch with ``tile_config``
and ``swap_config`` taken from another version of ``kernels/matmul_gluon.py`` (the kernels are this
version's), so that a change of the tile rules is timed against the rules before it in one run:

    git show <commit>:src/qflash/kernels/matmul_gluon.py > /tmp/matmul_gluon_old.py
    python3 benchmarks/gluon_mm_ab.py /tmp/matmul_gluon_old.py --m 16,128 --weights cold,warm \\
        --rounds 3 --rep-ms 30 --variants public,old --out ab.json

(Session 54's runs s54c / s54d named this script ``.old/ab.py`` and took the rules of 75bdf1d.)"""

import importlib.util
import sys

import gluon_mm_variants as variants
from qflash.kernels import matmul_gluon as gluon


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("qflash.kernels.matmul_gluon_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main():
    old = load_old(sys.argv.pop(1))
    variant, run = variants.variant, variants.run

    def old_variant(text):
        return {"old": True} if text == "old" else variant(text)

    def old_run(opts, *args):
        if not (opts and opts.get("old")):
            return run(opts, *args)
        new = gluon.tile_config, gluon.swap_config
        gluon.tile_config, gluon.swap_config = old.tile_config, old.swap_config
        gluon._plan.cache_clear()  # the plans follow the rules in force
        try:
            return run(None, *args)
        finally:
            gluon.tile_config, gluon.swap_config = new
            gluon._plan.cache_clear()

    variants.variant, variants.run = old_variant, old_run
    variants.main()


if __name__ == "__main__":
    main()
