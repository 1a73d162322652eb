//! The `Authorization` header workers and the hive accept: sdhive's bearer key (`--api-key`) and A1111's
//! `--api-auth user:pass[,user2:pass2]` (HTTP Basic, what A1111 clients such as webuiapi and Open WebUI send).
//! Either credential is accepted when configured; secrets are compared in constant time.

use base64::Engine as _;
use subtle::ConstantTimeEq;

/// A1111's `--api-auth` pairs (user, password); `Debug` shows the users only.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct BasicUsers(pub Vec<(String, String)>);

impl BasicUsers {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for BasicUsers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.0.iter().map(|(user, _)| format!("{user}:<redacted>"))).finish()
    }
}

/// What a server accepts. Nothing configured: every request passes (whatever `Authorization` it carries — Open
/// WebUI sends an empty `Basic ` value when its A1111 auth is unset).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    /// `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// `Authorization: Basic base64(user:password)`, any of these pairs.
    pub basic: BasicUsers,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("basic", &self.basic)
            .finish()
    }
}

/// A1111's `--api-auth` value: `user:password` pairs separated by commas (the password is everything after the
/// first colon). An empty value configures nothing.
pub fn parse_api_auth(value: &str) -> Result<BasicUsers, String> {
    let mut out = Vec::new();
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match entry.split_once(':') {
            Some((user, password)) if !user.is_empty() && !password.is_empty() => {
                out.push((user.to_string(), password.to_string()))
            }
            _ => {
                return Err(format!(
                    "an --api-auth entry must be `user:password` (entries separated by commas); got an entry of {} \
                     characters without one",
                    entry.len()
                ))
            }
        }
    }
    Ok(BasicUsers(out))
}

fn ct_eq(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

impl Credentials {
    pub fn new(api_key: Option<String>, basic: BasicUsers) -> Self {
        Credentials { api_key: api_key.filter(|k| !k.is_empty()), basic }
    }

    /// Whether requests must authenticate at all.
    pub fn required(&self) -> bool {
        self.api_key.is_some() || !self.basic.is_empty()
    }

    /// Whether `authorization` (the header's value) carries an accepted credential; `true` when none is required.
    pub fn accepts(&self, authorization: Option<&str>) -> bool {
        if !self.required() {
            return true;
        }
        let Some((scheme, token)) = authorization.and_then(|h| h.trim().split_once(' ')) else {
            return false;
        };
        let token = token.trim();
        if scheme.eq_ignore_ascii_case("bearer") {
            return self.api_key.as_deref().is_some_and(|key| ct_eq(token, key));
        }
        if !scheme.eq_ignore_ascii_case("basic") || self.basic.is_empty() {
            return false;
        }
        let Some(decoded) = base64::engine::general_purpose::STANDARD
            .decode(token)
            .ok()
            .and_then(|bytes| String::from_utf8(bytes).ok())
        else {
            return false;
        };
        let Some((user, password)) = decoded.split_once(':') else { return false };
        // Every pair is compared, so the time taken does not say which user exists.
        self.basic.0.iter().fold(false, |found, (u, p)| found | (ct_eq(user, u) & ct_eq(password, p)))
    }

    /// `WWW-Authenticate` values for a 401: Basic when user/password pairs are configured, Bearer when a key is.
    pub fn challenges(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if !self.basic.is_empty() {
            out.push("Basic realm=\"sdhive\"");
        }
        if self.api_key.is_some() {
            out.push("Bearer");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(user_pass: &str) -> String {
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(user_pass))
    }

    #[test]
    fn api_auth_values_parse_like_a1111() {
        assert_eq!(parse_api_auth("").unwrap().0, vec![]);
        assert_eq!(
            parse_api_auth("u1:p1, u2:p:2").unwrap().0,
            vec![("u1".to_string(), "p1".to_string()), ("u2".to_string(), "p:2".to_string())]
        );
        let e = parse_api_auth("u1:p1,secret").unwrap_err();
        assert!(!e.contains("secret"), "the error must not echo the value: {e}");
        assert!(parse_api_auth("u1:").is_err() && parse_api_auth(":p").is_err());
    }

    #[test]
    fn either_credential_is_accepted_when_configured() {
        let none = Credentials::default();
        assert!(!none.required());
        assert!(none.accepts(None) && none.accepts(Some("Basic ")) && none.accepts(Some("Bearer x")));

        let both = Credentials::new(Some("k1".into()), parse_api_auth("alice:pw,bob:hunter2").unwrap());
        assert!(both.accepts(Some("Bearer k1")) && both.accepts(Some("bearer  k1 ")));
        assert!(both.accepts(Some(&basic("alice:pw"))) && both.accepts(Some(&basic("bob:hunter2"))));
        assert!(both.accepts(Some(&basic("bob:hunter2").replace("Basic", "basic"))));
        for wrong in [
            None,
            Some("Basic "),
            Some("Basic !!!"),
            Some("Bearer k2"),
            Some("k1"),
            Some(basic("alice:hunter2").as_str()),
            Some(basic("alice").as_str()),
            Some(basic("carol:pw").as_str()),
        ] {
            assert!(!both.accepts(wrong), "{wrong:?}");
        }
        assert_eq!(both.challenges(), vec!["Basic realm=\"sdhive\"", "Bearer"]);

        let key_only = Credentials::new(Some("k1".into()), BasicUsers::default());
        assert!(!key_only.accepts(Some(&basic("k1:k1"))));
        assert_eq!(key_only.challenges(), vec!["Bearer"]);
        let basic_only = Credentials::new(None, parse_api_auth("a:b").unwrap());
        assert!(!basic_only.accepts(Some("Bearer a:b")) && basic_only.accepts(Some(&basic("a:b"))));
        assert!(!format!("{both:?}").contains("hunter2") && !format!("{both:?}").contains("k1"));
    }
}
