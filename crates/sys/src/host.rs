//! This machine's name.

/// The host name, as `gethostname(2)` (and Python's `socket.gethostname()`) gives it: on
/// Linux the `nodename` of `uname(2)`.
pub fn name() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}
