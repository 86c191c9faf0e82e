//! (to be written: the embedded, persistent backend)
