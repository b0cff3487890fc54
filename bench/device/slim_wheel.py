"""Copy a wheel without the parts the GPU machine never loads, so that a carry fits its 64 MiB.

    python bench/device/slim_wheel.py WHEEL OUT_DIR

Only distributions named in DROP are slimmed; any other wheel is copied as it is. The slim wheel keeps
its file name and metadata; its RECORD lists only the files it still holds (pip installs from RECORD's
neighbours, not from the dropped entries). What goes, and why it is safe:

- unsloth: ``studio/`` (its web UI's backend, 24.8 MiB of its 27.3 MiB zipped) and ``unsloth_cli/`` (the
  ``unsloth`` console command); ``import unsloth`` and ``FastLanguageModel`` import neither (checked: no
  module under unsloth/ or unsloth_zoo/ imports them).
- bitsandbytes: the native libraries for CUDA 11.x / 12.x, ROCm and XPU; it loads the one matching
  ``torch.version.cuda`` (the GPU image's torch is built for CUDA 13.0), so libbitsandbytes_cuda130.so,
  cuda132 and cpu stay.
- nvidia_cuda_runtime_cu12: its headers and static libraries; libcudart.so.12 stays (xformers' PyPI build
  links it, and the GPU image's CUDA is 13).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import zipfile

DROP = {
    "unsloth": re.compile(r"^(studio|unsloth_cli)/"),
    "bitsandbytes": re.compile(r"^bitsandbytes/libbitsandbytes_(cuda1[12]\d|rocm\d+|xpu\d+)\.so$"),
    "nvidia_cuda_runtime_cu12": re.compile(r"^nvidia/(?!cuda_runtime/lib/libcudart\.so)"),
}


def slim(wheel: str, out_dir: str) -> str:
    name = os.path.basename(wheel)
    dist = name.split("-")[0].lower()
    out = os.path.join(out_dir, name)
    drop = DROP.get(dist)
    if drop is None:
        shutil.copyfile(wheel, out)
        return out
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        kept = [i for i in src.infolist() if not drop.match(i.filename)]
        names = {i.filename for i in kept}
        for info in kept:
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "".join(ln + "\n" for ln in lines if ln.split(",")[0] in names).encode()
            dst.writestr(info, data)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    path = slim(sys.argv[1], sys.argv[2])
    before, after = (os.path.getsize(f) / 2**20 for f in (sys.argv[1], path))
    print(f"{os.path.basename(path)}: {before:.1f} -> {after:.1f} MiB")
