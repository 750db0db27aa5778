//! The configuration reference, `docs/reference/configuration.md`, generated from the
//! declaration in `settings`: one row per setting, its default and explanation taken from
//! the texts `--help` shows. The file is never edited by hand: a test fails when the
//! committed file differs from what this generates, and rewrites it when asked.

use clap::Arg;

use super::settings::Settings;

/// The command that rewrites the committed reference from the code.
pub const REGENERATE: &str = "BLESS_REFERENCE=1 cargo test --lib config::reference";

const HEADER: &str = "\
# Configuration reference

Each setting is read from its flag, else its environment variable, else the TOML file
given by `--config` (keys as in the first column, snake_case; a key the file does not know
is refused), else the default. The resolved configuration is logged at start-up with
secrets masked (passwords in URLs and in their query strings, tokens, the SMS hook).
`seckill --help` shows the same texts, `seckill -h` their first sentence.

A boolean flag given alone means true (`--dev`); it also takes a value (`--dev=false`), as
does its variable (`SECKILL_DEV=0`). A list is comma-separated.
";

/// The reference as markdown: the header, then one row per setting in declaration order.
pub fn reference_markdown() -> String {
    let mut out = format!(
        "{HEADER}\n<!-- Generated from src/config/settings.rs; do not edit. Regenerate with:\n     \
         {REGENERATE} -->\n\n\
         | setting | flag | environment | default | what it does |\n\
         |---|---|---|---|---|\n"
    );
    for arg in Settings::declared().get_arguments() {
        out.push_str(&row(arg));
    }
    out
}

fn row(arg: &Arg) -> String {
    let flag = arg.get_long().unwrap_or_default();
    let env = arg
        .get_env()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_default();
    let default = match literal_default(arg) {
        Some(value) => format!("`{value}`"),
        None => described_default(arg).unwrap_or_default(),
    };
    let cells = [
        arg.get_id().to_string(),
        format!("`--{flag}`"),
        format!("`{env}`"),
        default,
        explanation(arg),
    ];
    let cells: Vec<String> = cells.iter().map(|c| c.replace('|', "\\|")).collect();
    format!("| {} |\n", cells.join(" | "))
}

/// The default clap fills in, as `--help` shows it.
pub(super) fn literal_default(arg: &Arg) -> Option<String> {
    let values: Vec<String> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    (!values.is_empty()).then(|| values.join(","))
}

/// The default a setting's help describes, at the end of its first paragraph, as
/// `[default: ...]`: for a default worked out from other settings, or none at all.
pub(super) fn described_default(arg: &Arg) -> Option<String> {
    let help = full_help(arg);
    let first = help.split("\n\n").next()?.trim_end_matches('.');
    let start = first.rfind("[default: ")?;
    let text = first[start..]
        .strip_prefix("[default: ")?
        .strip_suffix(']')?;
    Some(text.to_string())
}

/// Every paragraph of the help, as `--help` shows it.
pub(super) fn full_help(arg: &Arg) -> String {
    arg.get_long_help()
        .or(arg.get_help())
        .map(|h| h.to_string())
        .unwrap_or_default()
}

/// The help without its described default, its paragraphs on one line.
fn explanation(arg: &Arg) -> String {
    let help = full_help(arg);
    let mut paragraphs: Vec<String> = help.split("\n\n").map(str::to_string).collect();
    if let Some(first) = paragraphs.first_mut() {
        if let Some(start) = first.rfind(" [default: ") {
            let end = first[start..]
                .find(']')
                .map_or(first.len(), |i| start + i + 1);
            first.replace_range(start..end, "");
        }
        if !first.ends_with('.') {
            first.push('.');
        }
    }
    paragraphs.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the reference is committed, from the crate's root.
    const REFERENCE_PATH: &str = "docs/reference/configuration.md";

    #[test]
    fn the_committed_reference_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(REFERENCE_PATH);
        let fresh = reference_markdown();
        if std::env::var_os("BLESS_REFERENCE").is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &fresh).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        let first_difference = committed
            .lines()
            .zip(fresh.lines())
            .find(|(a, b)| a != b)
            .map_or_else(
                || "(one is longer)".to_string(),
                |(a, b)| format!("committed: {a}\ngenerated: {b}"),
            );
        assert!(
            committed == fresh,
            "{REFERENCE_PATH} differs from the settings declared in src/config/settings.rs; \
             regenerate it with `{REGENERATE}` and commit it.\n{first_difference}"
        );
    }

    #[test]
    fn every_setting_states_its_default_once() {
        for arg in Settings::declared().get_arguments() {
            let name = arg.get_id();
            let literal = literal_default(arg).is_some();
            let described = described_default(arg).is_some();
            assert!(
                literal != described,
                "{name}: give either a default_value or, when the default is worked out \
                 from other settings, a `[default: ...]` ending the help's first paragraph"
            );
            assert_eq!(
                full_help(arg).matches("[default:").count(),
                usize::from(described),
                "{name}: the help states its default once"
            );
        }
    }

    #[test]
    fn the_defaults_layer_holds_every_literal_default_and_nothing_else() {
        let defaults = serde_json::to_value(Settings::defaults().unwrap()).unwrap();
        for arg in Settings::declared().get_arguments() {
            let name = arg.get_id().as_str();
            if name == "config" {
                continue;
            }
            assert_eq!(
                !defaults[name].is_null(),
                literal_default(arg).is_some(),
                "{name}"
            );
        }
    }

    #[test]
    fn every_setting_is_a_key_of_the_file_and_every_key_a_setting() {
        let declared: Vec<String> = Settings::declared()
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .filter(|name| name != "config")
            .collect();
        for name in &declared {
            let file = serde_json::json!({ name: null });
            assert!(
                serde_json::from_value::<Settings>(file).is_ok(),
                "{name} is no key of the file"
            );
        }
        let keys = serde_json::to_value(Settings::default()).unwrap();
        let mut keys: Vec<String> = keys.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        let mut sorted = declared.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
    }
}
