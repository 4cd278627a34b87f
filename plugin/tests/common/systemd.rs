//! `systemd-analyze verify` on units in a root of their own: the units, this machine's
//! system units (for the targets they name) and stand-ins for the programs they start.
//! Included with `#[path]` by the tests that check generated or shipped units.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

/// Why `systemd-analyze verify` cannot run here, if it cannot.
pub fn verify_unavailable() -> Option<String> {
    match Command::new("systemd-analyze").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        _ => {
            return Some(
                "systemd-analyze is not installed (Debian: apt-get install systemd; scripts/test.sh installs it)"
                    .into(),
            )
        }
    }
    if !Path::new("/usr/lib/systemd/system/multi-user.target").exists() {
        return Some("/usr/lib/systemd/system has no units to verify against".into());
    }
    None
}

/// Verifies the unit files `units` (name, contents) in a fresh root under `dir`, with an
/// executable stand-in at each path of `programs`. Template units are verified through an
/// instance (`@gpu0`). Any complaint fails, warnings included: an unknown key is only a
/// warning to systemd.
pub fn verify(dir: &Path, units: &[(String, String)], programs: &[&str]) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir.join("usr/lib/systemd")).unwrap();
    let copied = Command::new("cp")
        .args(["-a", "/usr/lib/systemd/system"])
        .arg(dir.join("usr/lib/systemd/"))
        .status()
        .unwrap();
    assert!(copied.success());
    let unit_dir = dir.join("etc/systemd/system");
    std::fs::create_dir_all(&unit_dir).unwrap();
    for (name, text) in units {
        std::fs::write(unit_dir.join(name), text).unwrap();
    }
    for p in programs {
        let path = dir.join(p.trim_start_matches('/'));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let names: Vec<String> = units
        .iter()
        .map(|(n, _)| n.replace("@.service", "@gpu0.service"))
        .collect();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", dir.display()))
        .args(&names)
        .current_dir(&unit_dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() && stderr.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("units {names:?}: {:?}\n{stderr}", out.status))
    }
}
