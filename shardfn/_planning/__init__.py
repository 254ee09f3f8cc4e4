"""Before training: what a plan costs (explain) and the plans that fit a budget (autoplan).
"""
