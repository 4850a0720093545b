"""Retrieval-augmented QA over Wikipedia passages (examples/rag): data, BM25 retrieval, the
sgl / DSPy / LangChain pipelines and their evaluation."""
