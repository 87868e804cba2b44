"""The Streamlit RCA dashboard (pages only; data through rca/ingest functions)."""
