"""The recorded program: jit_step(graph=True).

A step recorded once (graph), keyed by what it depends on (key), replayed as one program
(replay) or one CUDA graph (capture), with the state put back if its first calls raise
(restore); host and workspace say what a recorded program may hold.
"""
