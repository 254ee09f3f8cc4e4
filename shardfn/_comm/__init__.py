"""The communicator: every collective shardfn issues, and the ranks agreeing on it.

collectives issues them, eager or recorded (recording); the schedule guard (guard,
header, pipelined) has the ranks exchange a header first, so that ranks about to run
different collectives find out together, and a rank that compiles counts as busy
(compiling); failures is what a rank that raised tells its peers; events records what
was issued, for counts and logs.
"""
