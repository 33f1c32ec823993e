"""The node-link wire protocol and its crypto, shared by head and node. Imports nothing from Django."""
