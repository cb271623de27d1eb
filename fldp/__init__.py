"""fldp: reproduction suite for FL+FSDP and FL+HSDP (Mittone & Aldinucci, Euro-Par 2026)."""
from pathlib import Path

from omegaconf import OmegaConf

ASSETS = Path(__file__).parent / "assets"

# ${fldp_asset:diodati_1649/train.jsonl.gz} -> the file shipped inside the package
OmegaConf.register_new_resolver("fldp_asset", lambda rel: str(ASSETS / rel), replace=True)
