"""Graft a DFlash2 drafter's selector and convolutions onto another drafter of the same shape: out = sel's tensors
with every tensor base has replaced by base's, sel's config. python tools/probes/graft_selector.py SEL BASE OUT"""
import os
import shutil
import sys

from safetensors.torch import load_file, save_file

sel, base, out = sys.argv[1:4]
t, b = load_file(f"{sel}/model.safetensors"), load_file(f"{base}/model.safetensors")
if not (set(b) <= set(t) and all(t[k].shape == b[k].shape for k in b)):
    sys.exit(f"graft_selector: {base} is not a drafter of {sel}'s shape")
t.update({k: v.to(t[k].dtype) for k, v in b.items()})
os.makedirs(out, exist_ok=True)
save_file(t, f"{out}/model.safetensors", metadata={"format": "pt"})
shutil.copy(f"{sel}/config.json", out)
if os.path.exists(f"{base}/draft_vocab.json"):
    shutil.copy(f"{base}/draft_vocab.json", out)
print(f"{out}: {len(b)} tensors of {base}, {len(t) - len(b)} of {sel}")
