"""Root-cause analysis for LLM serving: evidence gathering, ranking, the `rca` CLI.

Importing this package must stay cheap: no torch, streamlit or pynvml here.
"""

__version__ = "0.1.0"
