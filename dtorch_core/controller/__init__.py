"""The controller: the session that owns ids, the instruction stream, recording and reads."""
