"""The state: a model's tree and the sharded tree made from it.

A module becomes a tree of named tensors (tree); a plan says which strategy and which
units (plan, units); resolved against a mesh it becomes the layout every rank agrees on
(resolve, layout, agreement); shard() places each rank's flat buffers (sharded, packing,
pieces, split_pieces, replica, offload, precision), deferred init fills them
(materialize), and reshard moves them under another plan. Nothing here runs a step.
"""
