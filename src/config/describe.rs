//! The start-up log's listing of the resolved configuration: one line per field of
//! `Config`, by name, and the serializers that mask its secrets where the fields are
//! declared. Never prints a secret, a password in a URL or the SMS hook's command line.

use super::values::GateKind;
use super::Config;
use crate::text::mask_url;

impl Config {
    /// One line per setting, secrets masked, for the start-up log: every field of the
    /// struct, by name, so a new setting is listed without touching this.
    pub fn describe(&self) -> String {
        let deployment = if self.embedded() {
            "embedded"
        } else {
            "distributed"
        };
        let mut lines = vec![format!("{:<28} = {deployment}", "deployment")];
        let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(self) else {
            return lines.join("\n");
        };
        for (name, value) in fields {
            let shown = match (name.as_str(), value) {
                ("order_log_dir", _) if self.gate != GateKind::Embedded => "(not used)".into(),
                (_, serde_json::Value::Null) => "(unset)".into(),
                (_, serde_json::Value::String(text)) => text,
                (_, other) => other.to_string(),
            };
            lines.push(format!("{name:<28} = {shown}"));
        }
        lines.join("\n")
    }
}

pub(super) fn secret<S: serde::Serializer>(
    value: &Option<String>,
    out: S,
) -> Result<S::Ok, S::Error> {
    out.serialize_str(if value.is_some() { "***" } else { "(unset)" })
}

pub(super) fn masked_url<S: serde::Serializer>(url: &str, out: S) -> Result<S::Ok, S::Error> {
    out.serialize_str(&mask_url(url))
}

pub(super) fn masked_url_opt<S: serde::Serializer>(
    url: &Option<String>,
    out: S,
) -> Result<S::Ok, S::Error> {
    match url {
        Some(url) => masked_url(url, out),
        None => out.serialize_none(),
    }
}

/// A duration in whole seconds, as its setting is given.
pub(super) fn seconds<S: serde::Serializer>(
    d: &std::time::Duration,
    out: S,
) -> Result<S::Ok, S::Error> {
    out.serialize_str(&format!("{} s", d.as_secs()))
}
