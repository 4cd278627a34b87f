//! `sqlx::migrate!` embeds `migrations/` at build time; without this, adding or editing a
//! migration would not rebuild the crate and the old copy would be embedded.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
