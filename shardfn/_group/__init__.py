"""A unit group: a unit's work in flight.

Its all-gathers (issue, wait, free) and the gathered parameters they give (gather), its
gradients' reduce-scatters (pack, issue, wait, unpack: reduce), and the buckets that let
neighbouring units share one collective (buckets).
"""
