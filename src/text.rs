//! Text shared by every layer: hex, URLs with their secrets masked, and phone numbers in
//! their one canonical spelling.
//! Pure functions; no I/O, no state, and nothing here imports another module of seckill.

use phonenumber::country::Id;

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hides the password of a URL such as `postgres://user:pw@host/db`, and the values of
/// query parameters that carry secrets (`?password=...`, `?sslpassword=...`, tokens).
pub fn mask_url(url: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let mut out = match base.split_once("://") {
        None => base.to_string(),
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((cred, host)) => match cred.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                None => format!("{scheme}://{cred}@{host}"),
            },
            None => base.to_string(),
        },
    };
    if let Some(query) = query {
        let masked: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _)) if secret_param(k) => format!("{k}=***"),
                _ => pair.to_string(),
            })
            .collect();
        out.push('?');
        out.push_str(&masked.join("&"));
    }
    out
}

fn secret_param(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["pass", "pwd", "secret", "token", "key", "auth"]
        .iter()
        .any(|s| k.contains(s))
}

/// Longest phone number text read at all: E.164's 15 digits, a `+` and room for spaces,
/// dashes and brackets.
const MAX_PHONE_TEXT: usize = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PhoneError {
    #[error("phone is not a phone number ({0})")]
    Unparsable(String),
    #[error("phone is not a valid number in its country (check the country code and length)")]
    NotValid,
    #[error("phone must not carry an extension: log in with a number that receives SMS")]
    Extension,
    #[error("phone is longer than {MAX_PHONE_TEXT} characters")]
    TooLong,
    #[error("phone may hold only digits, spaces, '+', '-', '.', '(' and ')'")]
    Characters,
}

/// The region of `code` (ISO 3166-1 alpha-2, any case), if libphonenumber knows it.
pub fn phone_region(code: &str) -> Option<Id> {
    code.to_ascii_uppercase().parse().ok()
}

/// A phone number in E.164 (`+8613800000001`), the one spelling that names a user: every
/// way of writing the same number (`8613800000001`, `008613800000001`, `138 0000 0001` in
/// region CN, with spaces, dashes or brackets) gives the same text. Numbers that are not
/// valid in their country, and numbers with an extension, are refused.
pub fn normalize_phone(raw: &str, region: Id) -> Result<String, PhoneError> {
    if raw.len() > MAX_PHONE_TEXT {
        return Err(PhoneError::TooLong);
    }
    // What a person types into a phone field, and what the published schema allows;
    // libphonenumber itself reads far more ("tel:" URIs, letters, extensions).
    if !raw
        .bytes()
        .all(|b| b.is_ascii_digit() || b" +-.()".contains(&b))
    {
        return Err(PhoneError::Characters);
    }
    let unparsable = |e: phonenumber::ParseError| PhoneError::Unparsable(e.to_string());
    let mut number = phonenumber::parse(Some(region), raw).map_err(unparsable)?;
    let region_code = phonenumber::metadata::DATABASE
        .by_id(region.as_ref())
        .map(|m| m.country_code());
    if Some(number.code().value()) != region_code {
        // The number named another country. phonenumber 0.3 strips the default region's
        // national prefix from it all the same (with region US, "+86 139 1234 5678" came
        // out as "+86 3912345678": another person); read without a default region, it
        // is judged by its own country's rules.
        number = phonenumber::parse(None, raw).map_err(unparsable)?;
    }
    if number.extension().is_some() {
        return Err(PhoneError::Extension);
    }
    if !number.is_valid() {
        return Err(PhoneError::NotValid);
    }
    Ok(number.format().mode(phonenumber::Mode::E164).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_passwords() {
        assert_eq!(
            mask_url("mysql://root:pw@h:3306/d"),
            "mysql://root:***@h:3306/d"
        );
        assert_eq!(
            mask_url("redis://127.0.0.1:6379/"),
            "redis://127.0.0.1:6379/"
        );
        assert_eq!(
            mask_url("postgres://u@h/db?sslmode=require&password=hunter2"),
            "postgres://u@h/db?sslmode=require&password=***"
        );
        assert_eq!(
            mask_url("redis://:p@ss@h:6379/0"),
            "redis://:***@h:6379/0",
            "an @ inside the password"
        );
        assert_eq!(mask_url("sqlite://seckill.db"), "sqlite://seckill.db");
    }

    #[test]
    fn every_spelling_of_one_number_is_one_text() {
        let cn = phone_region("cn").unwrap();
        for raw in [
            "+8613800000001",
            "8613800000001",
            "008613800000001",
            "+008613800000001",
            "13800000001",
            "+86 138 0000 0001",
            "+86-138-0000-0001",
            "(138) 0000 0001",
        ] {
            assert_eq!(
                normalize_phone(raw, cn).as_deref(),
                Ok("+8613800000001"),
                "{raw}"
            );
        }
        let us = phone_region("US").unwrap();
        assert_eq!(
            normalize_phone("(201) 555-0123", us).as_deref(),
            Ok("+12015550123")
        );
        for (raw, e164) in [
            ("+8613800000001", "+8613800000001"),
            ("+86 139 1234 5678", "+8613912345678"),
            ("+4915112345678", "+4915112345678"),
            ("+44 1234 567890", "+441234567890"),
        ] {
            assert_eq!(
                normalize_phone(raw, us).as_deref(),
                Ok(e164),
                "a country code beats the default region's rules: {raw}"
            );
        }
        // The US's international prefix read by phonenumber 0.3 with the US's rules gives
        // another number; refused rather than read as someone else.
        assert!(normalize_phone("011 86 139 1234 5678", us).is_err());
        let de = phone_region("DE").unwrap();
        assert_eq!(
            normalize_phone("0151 12345678", de).as_deref(),
            Ok("+4915112345678")
        );
    }

    #[test]
    fn what_is_not_one_phone_is_refused() {
        let cn = phone_region("CN").unwrap();
        for raw in ["", "+", "12345", "+ - ."] {
            assert!(
                matches!(normalize_phone(raw, cn), Err(PhoneError::Unparsable(_))),
                "{raw}"
            );
        }
        for raw in [
            "abc",
            "+861380000000１",
            "１３８００００００01",
            "tel:+8613800000001",
            "631-.400)-722 18*",
            "+8613800000001 ext. 12",
        ] {
            assert_eq!(
                normalize_phone(raw, cn),
                Err(PhoneError::Characters),
                "{raw}"
            );
        }
        for raw in ["+86138000000012", "+15550001234", "+4412345678901234"] {
            assert_eq!(normalize_phone(raw, cn), Err(PhoneError::NotValid), "{raw}");
        }
        assert_eq!(
            normalize_phone(&"1".repeat(33), cn),
            Err(PhoneError::TooLong)
        );
        assert!(phone_region("XX").is_none());
        assert!(phone_region("").is_none());
    }
}
