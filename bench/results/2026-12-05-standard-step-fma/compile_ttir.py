import sys, re, collections, subprocess, os, tempfile
import triton
from triton.backends.compiler import GPUTarget
folder = sys.argv[1]; fusion = sys.argv[2] == "fusion"
nv = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
for name in sorted(os.listdir(folder)):
    if not name.endswith(".ttir"): continue
    c = triton.compile(os.path.join(folder, name), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=1, num_stages=1, enable_fp_fusion=fusion))
    cubin = c.asm["cubin"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    sass = subprocess.run([os.path.join(nv, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m: ops[m.group(1).split(".")[0]] += 1
    res = subprocess.run([os.path.join(nv, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res).group(1) if re.search(r"REG:(\d+)", res) else "?"
    ttgir = c.asm["ttgir"]
    cvt = ttgir.count("convert_layout")
    print(f"{name:22s} regs {regs} shared {c.metadata.shared:6d} cvt_layout {cvt}  "
          + " ".join(f"{k}:{v}" for k, v in sorted(ops.items()) if k in ("FFMA","FMUL","FADD","SHFL","LDG","STG","STS","LDS","BAR","F2FP","PRMT")))
    open(os.path.join(folder, name + (".fusion" if fusion else ".nofusion") + ".ttgir"), "w").write(ttgir)
    open(os.path.join(folder, name + (".fusion" if fusion else ".nofusion") + ".sass"), "w").write(sass)
