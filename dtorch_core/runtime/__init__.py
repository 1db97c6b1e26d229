"""Controller session, runners, workers."""
