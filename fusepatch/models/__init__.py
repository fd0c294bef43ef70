"""Every built-in family table, in one list, newest families first."""

from fusepatch.models import qwen2, qwen3, qwen3_5, qwen3_next

BUILTIN_ROWS = [*qwen3_5.ROWS, *qwen3_next.ROWS, *qwen3.ROWS, *qwen2.ROWS]
