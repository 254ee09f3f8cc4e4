"""Parallelism inside a layer: the tensor axis and the sequence.

tensor splits nn.Linear and nn.Embedding layers over the mesh's "tensor" axis; call is
what a split layer's forward reads of the call it runs in; ops are its hand-written
collectives; features checks what may read a split output; rng is the tensor group's
random stream; agree is what a tensor group's ranks must agree on; sequence splits the
activations between split layers on the sequence.
"""
