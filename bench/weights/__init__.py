"""Weight updates measured: the handshake to a server, gloo bandwidth, full copy vs delta."""
