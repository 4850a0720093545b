"""The bundled inference server (import name ``server``).

Layers, arrows pointing one way: ``http`` -> tokenizer manager -> (IPC) -> ``scheduler`` ->
``cache`` and ``model`` -> ``kernels``. ``server.engine.Engine`` runs the scheduler and model in
process, without HTTP. See DESIGN.md in the shared folder for the full map.
"""
