"""A/B of code trees: argv = tree folder (or 'main'), batch, variants. The tree's replayssm_jax is imported
first and checked, so that bench/kernels.py (which puts the checkout on sys.path) cannot shadow it."""
import json, os, sys
root = os.getcwd()
tree = sys.argv[1]
sys.path.insert(0, root if tree == "main" else os.path.join(root, tree))
import replayssm_jax  # noqa: E402
expected = os.path.join(root if tree == "main" else os.path.join(root, tree), "replayssm_jax")
assert os.path.dirname(os.path.abspath(replayssm_jax.__file__)) == expected, (replayssm_jax.__file__, expected)
sys.path.insert(0, os.path.join(root, "bench"))
import numpy as np  # noqa: E402
import kernels as kb  # noqa: E402
assert replayssm_jax.kernels.__file__.startswith(expected)
kb.PROFILE = True
batch, kinds = int(sys.argv[2]), sys.argv[3].split(",")
rows, rng = [], np.random.default_rng(0)
VARIANTS = {"standard": ("standard", None, None, None), "direct": ("direct", 16, "empty", "direct"),
            "replay": ("replay-L16", 16, "staggered", "output")}
for layer in ("gdn", "mamba2"):
    bench = kb.make_bench(layer, batch, "float32", rng)
    for kind in kinds:
        name, L, cursors, route = VARIANTS[kind]
        r = kb.run_variant(bench, name, L, cursors, 7, route=route)
        kern = {k[:40]: round(v["us"], 2) for k, v in (r["kernels_us"] or {}).items() if v["us"] > 0.3}
        rows.append(dict(tree=tree, file=replayssm_jax.__file__, batch=batch, layer=layer, kind=kind,
                         step_us=r["seconds"] * 1e6, kernels=kern))
        print(f"{tree:8s} b{batch} {layer:7s} {kind:9s} step {r['seconds'] * 1e6:8.2f} us  {kern}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), f"ab_{tree}_b{batch}.json"), "w"), indent=1)
