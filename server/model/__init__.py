"""The model side: hyper-parameters (``config``), weight loading (``loader``), the Llama-family
decoder (``llama``), the ForwardBatch it consumes, the runner, and sampling."""
