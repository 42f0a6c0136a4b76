"""The one writer of a fitted hardware preset: ``bidirl calibrate RECORDS`` and ``bidirl calibrate --log`` both
write their document through :func:`write_hardware_preset`, which checks the file loads back as written."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Union


def write_hardware_preset(document: dict, knobs: Mapping[str, float], path: Union[str, Path], header: str,
                          what: str = "the preset path") -> Path:
    """Write ``header`` (comment lines) and ``document`` as YAML to ``path`` (``<name>.yaml``: a preset is named by
    its file), then load it back as a hardware preset and check every fitted knob reads back unchanged."""
    import yaml

    from bidirl.job import presets
    path = Path(path)
    if path.suffix != ".yaml":
        raise ValueError(f"{what} {str(path)!r}: a hardware preset is a .yaml file named after the preset "
                         "(e.g. cpu-calibrated.yaml)")
    body = yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=110)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + body)
    loaded = presets.load_hardware_file(path)
    for k, v in knobs.items():
        if getattr(loaded, k) != v:
            raise RuntimeError(f"{path}: knob {k} reads back as {getattr(loaded, k)!r}, not {v!r}")
    return path
