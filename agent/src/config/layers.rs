//! The [`settings!`] macro: from one declaration per setting it writes every place a
//! setting used to be written by hand — the command-line flags (with their variable),
//! the config-file key, the merge of the layers, the resolved [`super::Config`] field
//! and its check, and the list [`super::SETTINGS`] the tests walk.
//!
//! A hand-written `macro_rules!` rather than a layered-configuration crate: the flags
//! stay clap's (their help, their `[env: …]`, a flag winning over its variable), the
//! file stays serde's (`deny_unknown_fields`, errors with line and column), and each
//! setting's check keeps naming its flag; see docs/configuration.md.

/// Declares the agent's settings, in groups of flags (one clap [`clap::Args`] struct
/// each, flattened into the commands that take them). Each setting is written once:
///
/// ```text
/// /// The --help text [default: …].
/// #[arg(long = "flag-name", env = "RUNE_VARIABLE", …more clap attributes…)]
/// file_key: RawType => config_field: ConfigType = |raw: Option<RawType>| -> Result<ConfigType, String>,
/// ```
///
/// and becomes:
///
/// * the flag `--flag-name` and its variable `RUNE_VARIABLE` (a field
///   `Option<RawType>` of the group),
/// * the config-file key, `file_key` in camelCase (a field of [`super::FileConfig`]),
///   merged with the others by [`super::FileConfig::overridden_by`],
/// * the field `config_field` of [`super::Config`], the resolver's `Ok` (its default
///   and checks); its `Err` message is refused as `setting --flag-name: message`.
///   Resolvers run in declaration order and may read the settings resolved before
///   them by their `config_field` name,
/// * an entry of [`super::SETTINGS`].
///
/// `long` and `env` come first in `#[arg]`, in that order, so that the flag's and the
/// variable's names are in the list too.
macro_rules! settings {
    (
        $(
            $(#[doc = $group_doc:literal])*
            pub struct $group:ident {
                $(
                    $(#[doc = $doc:literal])*
                    #[arg(long = $long:literal, env = $env:literal $($arg:tt)*)]
                    $field:ident: $raw:ty => $name:ident: $resolved:ty = $resolve:expr
                ),* $(,)?
            }
        )*
    ) => {
        $(
            $(#[doc = $group_doc])*
            #[derive(Clone, Debug, Default, PartialEq, clap::Args)]
            pub struct $group {
                $(
                    $(#[doc = $doc])*
                    #[arg(long = $long, env = $env $($arg)*)]
                    pub $field: Option<$raw>,
                )*
            }

            impl From<$group> for FileConfig {
                fn from(group: $group) -> FileConfig {
                    FileConfig {
                        $($field: group.$field,)*
                        ..FileConfig::default()
                    }
                }
            }
        )*

        /// One layer of settings, every one optional: the config file's shape (keys in
        /// camelCase, unknown keys are errors), and what the flags and variables of a
        /// command set ([`From`] its groups).
        #[derive(Clone, Debug, Default, PartialEq, serde::Deserialize, serde::Serialize)]
        #[serde(deny_unknown_fields, rename_all = "camelCase")]
        pub struct FileConfig {
            $($(
                $(#[doc = $doc])*
                #[serde(skip_serializing_if = "Option::is_none")]
                pub $field: Option<$raw>,
            )*)*
        }

        impl FileConfig {
            /// This layer under `over`: each setting `over` has wins (flags and
            /// variables over the file, the file over the defaults).
            pub fn overridden_by(self, over: FileConfig) -> FileConfig {
                FileConfig {
                    $($($field: over.$field.or(self.$field),)*)*
                }
            }

            /// Each setting's default and checks, in declaration order; the first
            /// refusal names its flag.
            fn resolve_each(self) -> Result<Config, ConfigError> {
                $($(
                    let $name: $resolved = ($resolve)(self.$field).map_err(|message: String| {
                        ConfigError::Invalid {
                            setting: concat!("--", $long),
                            message,
                        }
                    })?;
                )*)*
                Ok(Config {
                    $($($name,)*)*
                })
            }

            /// Every group's flags, for a command that takes them all (tests).
            #[cfg(test)]
            pub(crate) fn augment_args(command: clap::Command) -> clap::Command {
                $(let command = <$group as clap::Args>::augment_args(command);)*
                command
            }

            /// The layer [`FileConfig::augment_args`]'s flags and variables set (tests).
            #[cfg(test)]
            pub(crate) fn from_arg_matches(
                matches: &clap::ArgMatches,
            ) -> Result<FileConfig, clap::Error> {
                let layer = FileConfig::default();
                $(
                    let group = <$group as clap::FromArgMatches>::from_arg_matches(matches)?;
                    let layer = layer.overridden_by(group.into());
                )*
                Ok(layer)
            }
        }

        /// Everything the agent's commands need, resolved and checked.
        #[derive(Clone, Debug, PartialEq)]
        pub struct Config {
            $($(
                $(#[doc = $doc])*
                pub $name: $resolved,
            )*)*
        }

        /// Every setting, in declaration order: its flag, variable and field.
        pub const SETTINGS: &[Setting] = &[
            $($(
                Setting {
                    flag: concat!("--", $long),
                    env: $env,
                    field: stringify!($field),
                },
            )*)*
        ];
    };
}

pub(super) use settings;
