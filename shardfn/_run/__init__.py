"""The step: what jit_step, jit_grad, functionalize and bind build, and what runs in one call.

A step's options are decided once (options); each call checks its batch (batch), opens
the runtime that owns what lives for the call (runtime), runs the loss through the
sharded call whose hooks drive the unit groups (call, remat, compile), hands the shard
gradients to the optimizer (gradients, psum), and writes nothing until the point of no
return has passed (no_return, verdict, buffers).
"""
