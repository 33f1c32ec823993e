"""The node side: dialing the head, engine workers, decode loops, replicas. Imports nothing from Django."""
