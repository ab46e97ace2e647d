"""Every kernel of one decode step (GPU time per step, launches per step, the HLO instructions behind it)
of a bench/configs model (or a config folder), plus the decode block's optimized HLO. Run from the repository root:
    PYTHONPATH=$PWD python3 probe_kernels.py CONFIG BATCH MODE OUT   (MODE: standard or L)"""
import json
import pathlib
import sys

import numpy as np
import jax.numpy as jnp

sys.path.insert(0, "bench")
import step_profile  # noqa: E402
from models.random_init import init_model  # noqa: E402
from replayssm_jax.generation import Generator  # noqa: E402

config, batch, mode, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], pathlib.Path(sys.argv[4])
folder = pathlib.Path(config) if pathlib.Path(config).is_dir() else pathlib.Path("bench/configs") / config
model = init_model(folder, jnp.bfloat16, ssm_state_dtype=jnp.float32)
kw = dict(state="standard") if mode == "standard" else dict(state="replay", buffer_len=int(mode))
gen = Generator(model, block_size=64, **kw)
prompts = np.random.default_rng(0).integers(3, model.config.vocab_size, size=(batch, 128)).astype(np.int32)
res = []
gen.generate(prompts, 64, progress=False)
full = step_profile.decode_breakdown(step_profile.trace(lambda: res.append(gen.generate(prompts, 64, progress=False))),
                                     hlo=gen.decode_hlo())
base = step_profile.decode_breakdown(step_profile.trace(lambda: gen.generate(prompts, 1, progress=False)),
                                     hlo=gen.decode_hlo())
tag = f"{folder.name}_b{batch}_{mode}"
(out / f"{tag}_hlo.txt").write_text("\n\n".join(gen.decode_hlo()))
if full is None:
    sys.exit("no GPU plane in the trace (a CPU run): the HLO only")
diff = step_profile.difference(full, base, top=1000)
steps = res[0].decode_steps
rows = sorted(((t / steps / 1e3, n / steps, name, diff["hlo_ops"].get(name, [])[:4])
               for name, (t, n) in diff["kernels"].items()), reverse=True)
(out / f"{tag}.json").write_text(json.dumps(dict(steps=steps, rows=rows), indent=1))
print(f"{tag}: us per step, launches per step, kernel, HLO ops")
for us, n, name, ops in rows[:45]:
    print(f"{us:9.1f} {n:6.2f} {name[:60]:60s} {' '.join(ops)[:90]}")
