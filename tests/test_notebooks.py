"""The postmortem notebook runs top to bottom against a demo store (library calls only)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the dev extra")
nbclient = pytest.importorskip("nbclient", reason="needs the dev extra")
pytest.importorskip("ipykernel", reason="needs the dev extra")
pytest.importorskip("plotly", reason="needs the app extra")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "postmortem.ipynb"
KV_TRACE = "000b019542c0d3a5fc78cb0dbcbaf7fb"


def _outputs(nb) -> str:  # type: ignore[no-untyped-def]
    parts: list[str] = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out["text"])
            elif "data" in out:
                parts.append(str(out["data"].get("text/plain", "")))
                if "application/vnd.plotly.v1+json" in out["data"]:
                    parts.append("<plotly figure>")
    return "\n".join(parts)


def test_postmortem_notebook_diagnoses_the_demo_incident(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rca.demo import run_demo

    db = tmp_path / "rca.duckdb"
    run_demo(db=db)
    monkeypatch.setenv("RCA_DB", str(db))  # the notebook reads the store from $RCA_DB
    monkeypatch.delenv("RCA_TRACE_ID", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook without outputs"
    )
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    text = _outputs(nb)
    assert f"{db}: 13 records, 12 spans" in text
    # the request with the most evidence of its own is the KV-corruption one
    assert f"trace {KV_TRACE}: symptom HTTP_500" in text
    assert "chain:      GPU_XID_48 -> KV_BLOCK_HASH_MISMATCH -> LOGITS_NAN -> HTTP_500" in text
    assert f"CLI: rca query --trace-id {KV_TRACE} --db {db}" in text
    assert text.count("<plotly figure>") == 2  # the span timeline and the GPU plot
    assert "GPU_XID_63" in text  # the Xid table of the last cell
