"""Publish: rank 0's weight-update handshake with the controller and the servers."""
