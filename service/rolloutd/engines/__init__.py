"""Generation engines behind one protocol. Heavy engines (vLLM) are imported only when chosen."""
