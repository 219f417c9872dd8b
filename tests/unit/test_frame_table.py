"""The shadow commands' tables printed to a file or pipe keep one line per row; a terminal (or
``COLUMNS``) keeps its own width."""

from __future__ import annotations

import pandas as pd

from kvdiag.commands._frame_table import COMPRESSION_COLUMNS, UNWRAPPED_COLUMNS, frame_table, table_console

ROWS = [{"group": g, "method": m, "ratio": 4.0, "k_rel_error": 0.0264, "v_rel_error": 0.0278,
         "attn_score_error": 0.0125, "attn_out_rel_error": 0.0153, "attn_out_rel_error_lo": 0.0151,
         "attn_out_rel_error_hi": 0.0155, "steps": 12, "encode_us": 383.0, "decode_us": 1080.0,
         "seq_len_tokens": 430} for g in ("1-6", "7-12") for m in ("fp8_e4m3:s=1", "int4")]


def _printed(capsys) -> list[str]:
    table_console().print(frame_table("compression", pd.DataFrame(ROWS), COMPRESSION_COLUMNS, digits=3))
    return capsys.readouterr().out.splitlines()


def test_piped_tables_are_not_folded(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert table_console().width == UNWRAPPED_COLUMNS  # pytest's captured stdout is no terminal
    rows = [line for line in _printed(capsys) if line.startswith("│")]
    assert len(rows) == len(ROWS)  # one line each, every cell whole
    assert all("fp8_e4m3:s=1" in r or "int4" in r for r in rows)


def test_columns_is_obeyed(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert table_console().width == 80
    rows = [line for line in _printed(capsys) if line.startswith("│")]
    assert len(rows) > len(ROWS)  # folded, as the user asked for 80 columns
