// Anchor source for libtessera.so, which is made of the client archive.
